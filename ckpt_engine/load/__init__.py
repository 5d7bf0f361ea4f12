"""The load path: a committed checkpoint opened and its metadata checked (:mod:`.open`), where the bytes
read go (:mod:`.places`), reading and verifying them on several threads (:mod:`.read`, :mod:`.shares`),
filling a live state in place (:mod:`.into`), and the collective restore every rank agrees on
(:mod:`.agreed`), with the replicated state read once and exchanged (:mod:`.exchange`)."""
