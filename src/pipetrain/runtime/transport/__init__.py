"""Runtime transport: the messages between stages (encoding, the wire, posted receives,
what a peer surely received), the process groups and the routes between stages."""
