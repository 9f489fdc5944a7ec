"""ZeRO-3 tools: buffers right where DeepSpeed partitions the parameters.

- ``gathered``: ``GatheredParametersAndBuffers``, DeepSpeed's ``GatheredParameters`` that also keeps module
  buffers right (``_ReadOnly`` for ``modifier_rank=None``, ``_Commit`` for ``modifier_rank=r``).
- ``zero_init``: ``Init`` and ``install()`` / ``uninstall()`` / ``installed()``: every module built under
  ``zero.Init`` gets the source rank's buffers, and the patches that make DeepSpeed's own contexts and
  ``from_pretrained`` do the same.
- ``_owners``: which modules a list of ZeRO parameters names (the record kept while ``install()`` / ``Init`` are
  active, a ``parameters()`` generator's module, ``fwd_module``, the heap search).
- ``no_zero_init``: ``no_zero_init()``, build full plain modules while ZeRO-3 partitioning is active.
- ``frozen_replica``: ``frozen_replica`` / ``is_frozen_replica``: a frozen module as a plain, identical replica on
  every rank ([Note: pickled replicas]).

Built on ``zero_buffers._core``, ``zero_buffers.broadcast`` and ``zero_buffers.report``; DeepSpeed and transformers
only through ``zero_buffers._compat``.
"""
