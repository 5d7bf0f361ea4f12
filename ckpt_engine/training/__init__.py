"""What a training loop needs around the engine: when to checkpoint (:mod:`.policy`,
:mod:`.schedule`), where the data loader stands (:mod:`.resumable`), preemption (:mod:`.preempt`)
and the per-checkpoint figures (:mod:`.figures`). :mod:`.session` puts them together around one
job's :class:`~ckpt_engine.Checkpointer` (what a checkpoint holds: :mod:`.parts`); the front ends
are adapters that drive a session."""
