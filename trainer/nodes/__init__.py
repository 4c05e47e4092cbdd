"""Many nodes, each with its own hot root: which ranks share a root (``topology``), the two-level commit,
recovery and resume from peers' replicas (``twolevel``), files sent over the checkpoint group (``transport``)."""
