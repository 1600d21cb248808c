-- When each run event was projected, on the database's clock. A subscriber fed from the store
-- that meets a hole (a seq missing below one already stored) waits for it for as long as the
-- missing events may still come: UPSQUAD_HUB_HOLE_WAIT after the event above the hole was
-- stored, which is longer than the projection's ack wait (a message a replica fetched and
-- died holding comes back to another replica within it). The age is the stored row's, not
-- the subscriber's own first sighting, so an old hole (events lost for good) is skipped at
-- once by every later subscriber. Rows stored before this column carry the migration's time.
ALTER TABLE run_events ADD COLUMN projected_at timestamptz NOT NULL DEFAULT now();
