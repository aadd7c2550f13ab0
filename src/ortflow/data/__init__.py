"""The data stage: raw sources in, checksummed binary shards out, and the reader that training uses."""
