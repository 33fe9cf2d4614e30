"""The pools a block id names. Ids are counted per pool and shared by the layers: block 7 of
the main pool is block 7 in every layer's main-pool tensors."""

MAIN = "main"  # the layer's formats: exact blocks, summaries, kept and resident staging blocks
RECENT = "recent"  # fp16: the recent region and an unfinished channel-scaled key block
HOST = "host"  # the host tier: an exact copy of every pooled block (selecting layers only)
INDEX = "index"  # key bounds or means of pooled blocks, block_size to a block (selecting layers)
STAGE = "stage"  # streamed staging: one pool per distinct layer format, filled layer by layer
# The pools that live on the device (the host tier does not), and all of them.
DEVICE_KINDS = (MAIN, RECENT, INDEX, STAGE)
POOL_KINDS = (*DEVICE_KINDS, HOST)
