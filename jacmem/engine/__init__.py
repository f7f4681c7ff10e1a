"""How a backward pass is extended (internal): the block, its engines and what they share.

Public names live in :mod:`jacmem`; the one engine class a user of the block's parts
needs is :class:`jacmem.engine.block.Block`.
"""
