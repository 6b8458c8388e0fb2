"""The daemon's edges: the client socket and its sessions, request handling,
the peer wiring, the statistics endpoint, and the server lifecycle."""
