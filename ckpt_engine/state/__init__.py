"""The state as the format stores it: a training state encoded into tensors and a typed-JSON tree
(:mod:`.values`), read back safely from untrusted bytes (:mod:`.decode`), and the save plan that
gives each rank its slice of every replicated tensor (:mod:`.plan`)."""
