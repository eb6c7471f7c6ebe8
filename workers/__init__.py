"""The hetd worker runtime: connect to a daemon, train on a share of the data, push updates."""
