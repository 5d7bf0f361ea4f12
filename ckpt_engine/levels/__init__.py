"""Multi-level persistence: levels opened and checked together (:mod:`.open`), the saving side
(:mod:`.multilevel`), background flushers to the lower levels (:mod:`.flush`, copying with
:mod:`.transfer`), and restoring from the fastest level that verifies (:mod:`.restore`)."""
