"""DCP's own layers, as ckptflow fills them: the planners (``planner``), a writer hashing each file as it writes it
(``writer``), a stager restaging an unchanged layout by copies (``staging``) and a reader verifying every byte as it
reads it (``reader``). Each subclasses DCP's default, so what they write and read is plain DCP; ``_`` modules are
internals."""
