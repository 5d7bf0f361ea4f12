"""The save path, in the order a checkpoint travels: where the rank's share goes in its data file
(:mod:`.layout`), the reused host buffers it is copied into (:mod:`.buffers`; on a memory level files
of its tmpfs, :mod:`.filebuffers`), the copy training waits for (:mod:`.copy`, :mod:`.cuda_copy`,
:mod:`.snapshot`), the background persist (:mod:`.persist`), the commit (:mod:`.commit`), what a failed
save leaves and who removes it (:mod:`.failure`), and the figures of it all (:mod:`.tally`)."""
