"""One module per benchmarked system; the contract is bench.peers.base.Peer."""
