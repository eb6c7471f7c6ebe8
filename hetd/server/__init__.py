"""The daemon's shell: websocket sessions, the admin API, metrics and checkpoints."""
