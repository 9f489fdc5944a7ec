"""BatchNorm tools: statistics that describe every rank's data, not one rank's.

- ``average``: ``average_bn_stats``, the exact float64 merge of the ranks' running statistics, and the sums it
  all-reduces, which ``sync_buffers``, ``keep_in_sync`` and registered ``"bn"`` rules reuse
  ([Note: the BatchNorm sums], [Note: repeated merges]).
- ``recompute``: ``recompute_bn_stats``, exact population statistics from a pass over every rank's data.
- ``_global_batch``: the recompute passes in which every BatchNorm normalises by the batch of all ranks together
  (``global_batch=True``).

Built on ``zero_buffers._core`` only.
"""
