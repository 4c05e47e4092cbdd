"""The checkpoint's on-disk format and its commit: names (``layout``), the manifest and its
signature (``manifest``), digests (``checksum``), DCP's ``.metadata`` read without trusting it
(``dcpmeta``), what "committed" means on a folder or an object store (``atomicity``) and the
commit on one shared root (``commit``). Plain files and rules: no torch collective here."""
