"""The gRPC plumbing every specdec service shares: errors to status codes, health and the server
(service), the step stream's service side (steps), transport security (security), admission and
graceful drain (lifecycle), telemetry (telemetry, instruments) and probability rows on the wire
(wire). It owns no model: it calls a service's engine (specdec.runtime), never the other way."""
