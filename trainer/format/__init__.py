"""The on-disk format and its commit: names (``layout``), the signed manifest (``manifest``), digests
(``checksum``), DCP's ``.metadata`` read without trusting it (``dcpmeta``), what "committed" means on a folder or
an object store (``atomicity``), the commit on one shared root (``commit``). No torch collective here."""
