-- The trace of the work that wrote an outbox row (the calling RPC's trace id, else the run's):
-- the relay publishes each row with it in a traceparent header, so a run's events, its agent
-- dispatches and approval decisions carry the trace of the call behind them across the bus.
ALTER TABLE outbox ADD COLUMN trace_id text NOT NULL DEFAULT ''
    CHECK (length(trace_id) <= 64);
