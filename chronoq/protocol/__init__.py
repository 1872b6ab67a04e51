"""Wire codecs, pure (no I/O, no asyncio, no grpc): `requests` decodes RocketMQ v2 requests into
chronoq commands, `responses` encodes results and errors, `admin` is the JSON admin codec, `v2`
is the one import of the generated `apache.rocketmq.v2` modules. The server (`chronoq.server`)
is the thin I/O shell around them."""
