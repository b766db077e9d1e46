"""Execution: a rank runs its own plan. Host staging of device tensors (``staging``), writing its chunks and its part of the commit (``save``), reading, agreeing and exchanging regions (``load``), and placing what was read into the request's tensors (``loaded``).

May import: ``shardstore.protocol``, ``shardstore.planning`` and the layers below them.
"""
