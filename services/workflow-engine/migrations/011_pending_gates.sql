-- The pending human gates of every org as ids and times only (like run_queue): what the
-- workflow_engine_pending_approvals gauges count in one service-scoped read, kept by a trigger
-- on governance so that no path that opens, decides, expires or closes a gate can forget it.
CREATE TABLE pending_gates (
    id         uuid PRIMARY KEY,
    org_id     uuid NOT NULL,
    created_at timestamptz NOT NULL
);
ALTER TABLE pending_gates ENABLE ROW LEVEL SECURITY;
ALTER TABLE pending_gates FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_or_service ON pending_gates
    USING (org_id = tenant() OR service_scope())
    WITH CHECK (org_id = tenant() OR service_scope());
REVOKE ALL ON pending_gates FROM PUBLIC;

CREATE FUNCTION track_pending_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM pending_gates WHERE id = OLD.id;
        RETURN OLD;
    END IF;
    IF NEW.status = 'pending' THEN
        INSERT INTO pending_gates (id, org_id, created_at)
        VALUES (NEW.id, NEW.org_id, NEW.created_at) ON CONFLICT (id) DO NOTHING;
    ELSE
        DELETE FROM pending_gates WHERE id = NEW.id;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER governance_pending AFTER INSERT OR UPDATE OF status OR DELETE ON governance
    FOR EACH ROW EXECUTE FUNCTION track_pending_gate();

-- the gates pending at upgrade: the owner lifts FORCE for this one statement (the tenant
-- policy hides every row from a session without an org), inside the migration's transaction
ALTER TABLE governance NO FORCE ROW LEVEL SECURITY;
ALTER TABLE pending_gates NO FORCE ROW LEVEL SECURITY;
INSERT INTO pending_gates (id, org_id, created_at)
    SELECT id, org_id, created_at FROM governance WHERE status = 'pending';
ALTER TABLE governance FORCE ROW LEVEL SECURITY;
ALTER TABLE pending_gates FORCE ROW LEVEL SECURITY;
