"""The core every tool runs on: one transactional sync over a resolved group, and what it is built from.

Nothing here imports a tool (``bn``, ``zero3``, ``training``, ``doctor``, ``broadcast``, ``report``): only
``zero_buffers._compat`` and ``zero_buffers.errors`` from outside this package. The modules, from the top down:

- ``transaction``: the one transactional sync every public function that changes buffers uses (``commit``,
  ``broadcast``, ``Phase``; [Note: the transaction]).
- ``structure``: a call's structure as data (``Spec``), its digest, ``agree()`` (the first collective of every
  call) and the error when ranks differ.
- ``wire``: the deadline (``Deadline``), control collectives, the bucket plan and the coalesced data collectives.
- ``group``: the ``Group`` a call runs over, resolved from a ProcessGroup or a DeviceMesh, with the ``Mesh`` as data
  ([Note: rank convention]).
- ``placement``: DTensor buffers by their local tensors, each entry's role along each mesh dimension and the group
  each collective runs over ([Note: placements]).
- ``args``: argument checks run at the call, before any collective (one validator per kind, ranks included).
- ``modules``: unwrapping engines and wrappers, buffers by qualified name, the BatchNorm layers that track.
- ``digest``: content digests (host SHA-1, the on-device fingerprint) that ``buffer_report`` and ``keep_in_sync``
  compare.
- ``compare``: element-wise comparisons in float64, a chunk at a time, and the walk in logical order (shared by the
  report and the checkpoint doctor).
- ``rollback``: snapshots of modules and their rollback, for transactions that run user code before they commit.
- ``notice``: what the library writes on stderr: its warnings, on the group's first rank only and some once per
  process, and its progress reports (a bar on a terminal, plain lines elsewhere).
"""
