"""The live stream: the live producer, its stream log, one rank's live partitions and the ledger that audits them."""
