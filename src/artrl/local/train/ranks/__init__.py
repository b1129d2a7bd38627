"""Training in N processes (FSDP2): the ranks seen from the main process, one rank's process, each rank's rows."""
