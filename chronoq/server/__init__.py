"""The gRPC server: `grpc_service` (apache.rocketmq.v2.MessagingService), `admin_service`
(chronoq.admin.v1.Admin, JSON), `renewals` (auto_renew bookkeeping), `serve` (process lifecycle:
TLS, health, signals). Above the broker; nothing below imports from here."""
