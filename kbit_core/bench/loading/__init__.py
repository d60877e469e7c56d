"""The loading benchmark: each rank times loading its shard per configuration (rank side), and the reports made
from those timings (driver side)."""
