"""Several devices per base model: a torch.distributed group of one process per device.

``launch`` (the supervisor `serve --world-size N` runs), ``comm`` (a rank's process group and the
command channel), ``trainer`` (rank 0's GroupTrainer and the other ranks' Follower), ``sharded`` (full
runs sharded with FSDP2), ``rank`` (the main of a rank other than 0).
"""
