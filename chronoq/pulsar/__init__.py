"""chronoq's Pulsar door: Apache Pulsar's binary protocol over chronoq's broker (`codec.py`, `door.py`)."""
