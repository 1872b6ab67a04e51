"""The official RocketMQ clients (Python and Node.js) against a real chronoq server."""
