"""Precompute with a shard writer that takes DELAY seconds a shard (a slow disk), for the kill -9 test:
python tests/_slow_writer.py DELAY [precompute arguments...]"""
import sys
import time

from precompute import cosmos_latents, shard_writer

delay = float(sys.argv[1])
write = shard_writer.ShardWriter.write
shard_writer.ShardWriter.write = lambda self, *job: (time.sleep(delay), write(self, *job))[1]
sys.exit(cosmos_latents.main(sys.argv[2:]))
