"""Multi-level persistence: levels opened and checked together (:mod:`.open`), the destination of a
``Checkpointer`` with several levels (:mod:`.multilevel`), background flushers to the lower levels
(:mod:`.flush`, copying with :mod:`.transfer`), and restoring from the fastest level that verifies
(:mod:`.restore`)."""
