"""BatchNorm statistics drift apart across ranks. Run: torchrun --nproc_per_node 2 examples/bn_divergence.py"""
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb

dist.init_process_group("gloo")                    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
rank = dist.get_rank()
torch.manual_seed(0)                               # the same initial weights on every rank
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
ddp = nn.parallel.DistributedDataParallel(model)   # broadcasts rank 0's buffers once, here
ddp.broadcast_buffers = False                      # and not before every forward (the same on torch 2.3 to 2.15)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for _ in range(20):                                # each rank trains on its own shard of the data;
    x = torch.randn(32, 4) * (1 + rank) + 3 * rank  # rank 1's is shifted and wider
    opt.zero_grad()
    ddp(x).pow(2).mean().backward()                # DDP averages the gradients, not the buffers
    opt.step()

report = zb.buffer_report(model)                   # a collective: every rank calls it
if rank == 0:
    print("BUG:", report.format())                 # a checkpoint saved now carries rank 0's statistics only
zb.average_bn_stats(model)                         # every rank now holds the exact merge of both ranks'
report = zb.buffer_report(model)
if rank == 0:
    print("FIX:", report.format())
dist.destroy_process_group()
