"""This process's host: huge pages for large fresh allocations (:mod:`.hugepages`), the memory it can
have before a read allocates (:mod:`.headroom`), holding the garbage collector off while a checkpoint
has the training thread (:mod:`.collector`), and page-locking memory it mapped for CUDA copies
(:mod:`.pinning`)."""
