"""`opd`, the command line: the top layer (it may import flows/, pipeline/, models/, storage/)."""
