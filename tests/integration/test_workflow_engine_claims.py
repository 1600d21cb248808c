"""workflow-engine claims over real gRPC, Postgres and NATS: a claim leases at most the runs its
thread ticks (UPSQUAD_WF_GROUP_MAX per interpreter thread), however many are due at once, and
every run it leases is ticked at once rather than left leased until the lease expires.

60 runs park on a signal; the admin role then makes them all due in one statement (as a burst of
deliveries would), while a sampler in Postgres watches how many of them are leased. One engine
with one interpreter thread and groups of 4: never more than 4 leased, and all 60 ticked (each
parks again, its lease released) within seconds, far below the 15 s lease. A fresh org; the
engine is stopped by pid."""
import os
import secrets
import subprocess
import sys
import time
import unittest
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
from upsquad_testlib import psql, with_database  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_WORKFLOW_ENGINE")
ADMIN_DSN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not NATS or not ADMIN_DSN:
    print("SKIP: UPSQUAD_PG_DSN_WORKFLOW_ENGINE, UPSQUAD_PG_ADMIN_DSN and UPSQUAD_NATS_URL are required")
    sys.exit(0)

from upsquad.workflow.v1 import workflow_pb2 as W  # noqa: E402

SECRET = secrets.token_hex(16)
RUNS, GROUP = 60, 4


class Claims(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = T.Server("workflow-engine", env=T.engine_env(
            DSN, NATS, SECRET, UPSQUAD_WF_WORKERS="1", UPSQUAD_WF_GROUP_MAX=str(GROUP),
            UPSQUAD_WF_LEASE="15s"))
        cls.org = str(uuid.uuid4())
        cls.c = T.WorkflowClient(cls.srv.addr, T.mint(SECRET, sub=str(uuid.uuid4()), org=cls.org,
                                                      clearance=5))
        cls.admin = with_database(ADMIN_DSN, urllib.parse.urlsplit(DSN).path.lstrip("/"))

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.srv.stop()

    def leased(self):
        return int(psql(self.admin, "SELECT count(*) FROM workflow_engine.run_queue WHERE org_id = '%s' "
                                    "AND lease_until > clock_timestamp()" % self.org))

    def test_a_claim_leases_no_more_than_its_group(self):
        d = {"version": 1, "start": "w", "steps": {"w": {"type": "wait", "mode": "signal", "event_key": "go"}}}
        wf = self.c("CreateWorkflow", W.CreateWorkflowRequest(name="claims", definition=T.struct(d))).workflow
        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(lambda _: self.c("TriggerWorkflow", W.TriggerWorkflowRequest(
                workflow_id=wf.id)).run.id, range(RUNS)))
        q = "SELECT count(*) FROM workflow_engine.run_queue WHERE org_id = '%s' AND wake_at IS NULL" % self.org
        end = time.time() + 30
        while int(psql(self.admin, q)) < RUNS and time.time() < end:  # every run parked
            time.sleep(0.1)
        self.assertEqual(int(psql(self.admin, q)), RUNS)
        # the most runs of the org leased at once, sampled every 2 ms for 2 s inside Postgres
        sampler = subprocess.Popen(
            ["psql", self.admin, "-X", "-Atq", "-v", "ON_ERROR_STOP=1", "-c",
             "CREATE FUNCTION pg_temp.most_leased() RETURNS int LANGUAGE plpgsql AS $$ "
             "DECLARE m int := 0; c int; BEGIN FOR i IN 1..1000 LOOP "
             "SELECT count(*) INTO c FROM workflow_engine.run_queue WHERE org_id = '%s' "
             "AND lease_until > clock_timestamp(); m := greatest(m, c); PERFORM pg_sleep(0.002); "
             "END LOOP; RETURN m; END $$; SELECT pg_temp.most_leased()" % self.org],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.2)
        t0 = time.time()
        psql(self.admin, "UPDATE workflow_engine.run_queue SET wake_at = now() WHERE org_id = '%s'" % self.org)
        # every run ticked: parked again, its lease released, within seconds (not the lease)
        while int(psql(self.admin, q)) < RUNS and time.time() - t0 < 10:
            time.sleep(0.02)
        took = time.time() - t0
        out, err = sampler.communicate(timeout=60)
        self.assertEqual(sampler.returncode, 0, err)
        most = int(out.split()[-1])
        print("%d runs due at once: at most %d leased, all ticked in %.2f s" % (RUNS, most, took), file=sys.stderr)
        self.assertEqual(int(psql(self.admin, q)), RUNS)
        self.assertLess(took, 5)
        self.assertEqual(self.leased(), 0)
        self.assertGreater(most, 0)  # the sampler saw the claims
        self.assertLessEqual(most, GROUP)  # one thread, one group: never more leased
        for r in runs[:3]:
            s = self.c("GetWorkflowStatus", W.GetWorkflowStatusRequest(run_id=r))
            self.assertEqual((s.run.status, s.actions[0].status), ("running", "waiting"))


if __name__ == "__main__":
    unittest.main(verbosity=2)
