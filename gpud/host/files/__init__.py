"""Files gpud reads or writes as root: the one safe reader/writer, its state files, the layout file."""
