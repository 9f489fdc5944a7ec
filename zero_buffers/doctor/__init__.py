"""The checkpoint doctor: find and repair diverged buffers in checkpoints already written, offline (no process
group, no GPU); the ``zero-buffers inspect | diff | repair`` commands.

- ``report``: ``checkpoint_report`` / ``CheckpointReport``, and the reading and comparing a repair shares.
- ``repair``: ``repair_checkpoint`` / ``RepairResult`` and ``recover_checkpoint``
  ([Note: what the doctor may write]).
- ``_files``: which kind a path is (DeepSpeed, DCP, Accelerate, per-rank files, one file), its lazy readers and the
  writers of a rank file.
- ``_checks``: what is checked before a file someone else wrote is opened (regular files only, content of the kind
  its name says, zip archives laid out as ``torch.save`` writes them).
- ``_copy``: the repaired copy, built in a staging folder (rank files rewritten and re-read, the rest copied).
- ``_atomic``: putting that copy in place so a crash leaves the old or the new folder whole; leftovers found,
  described and undone.
- ``_dtypes``: dtypes offline: which buffers must be float32 or integers by their names (the defaults of
  [Note: declared precision], mirrored by name), and casting a buffer back to a training checkpoint's dtype exactly.
- ``_words``: messages built as parts, so one message names ``in_place=True`` in Python and ``--in-place`` on the
  command line; why a reader stopped, in words (never an exception's class name).
- ``example``: ``zero-buffers example-checkpoint``: a small checkpoint whose ranks diverged (zero3, per-rank, dcp),
  written by real local gloo ranks; the only module here that starts processes, and no reader imports it.

Imports nothing of the online tools: ``zero_buffers._core`` (comparisons, warnings), ``zero_buffers.report``
(its table), ``zero_buffers.precision.declared`` (the ``Declared`` type) and ``zero_buffers._compat`` only.
"""
