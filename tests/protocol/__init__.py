"""The RocketMQ v2 wire codec: requests, replies, the fast paths and hostile input."""
