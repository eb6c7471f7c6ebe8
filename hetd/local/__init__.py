"""Local processes: the demo, and starting and stopping a daemon and workers on this host."""
