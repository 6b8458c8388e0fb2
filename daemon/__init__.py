"""gradsync.daemon: the node daemon `gradsyncd`."""
