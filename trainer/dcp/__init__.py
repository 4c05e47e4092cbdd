"""DCP's own layers, as ckptflow fills them: the planners (``planner``), the storage writer that
hashes each file as it writes it (``writer``), the stager that restages an unchanged layout by
copies (``staging``) and the storage reader that verifies every byte as it reads it (``reader``).
Each subclasses DCP's default for that layer, so what they write and read is plain DCP. Modules
with a leading underscore are their internals."""
