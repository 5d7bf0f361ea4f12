"""What a training loop needs around the engine: when to checkpoint (:mod:`.policy`,
:mod:`.schedule`), where the data loader stands (:mod:`.resumable`), preemption (:mod:`.preempt`)
and the per-checkpoint figures (:mod:`.figures`). The front ends drive these."""
