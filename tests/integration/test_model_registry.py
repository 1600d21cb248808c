"""model-registry over real gRPC (grpcio), with real Postgres and NATS.

The test creates a throw-away database (when UPSQUAD_PG_ADMIN_DSN is set; otherwise it uses the
runtime's database and restores the shipped catalogue at the end), starts replicas of
build/bin/model-registry on free loopback ports and stops them by pid:
  A  loads a copy of the shipped data file (plus a few test-only models) and is reloaded by
     SIGHUP;
  B  loads no file and polls only once an hour, so a change reaches it through NATS or not at
     all;
  C  is started late with the same file, to show a restart changes nothing.
Expected rankings are recomputed here from the formulas in docs/model-registry.md, independently
of the C code.
"""
import copy
import datetime
import json
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import upsquad_testlib as T  # noqa: E402
from upsquad_testlib import psql, with_database  # noqa: E402

DSN = os.environ.get("UPSQUAD_PG_DSN_MODEL_REGISTRY")
ADMIN_DSN = os.environ.get("UPSQUAD_PG_ADMIN_DSN")
NATS = os.environ.get("UPSQUAD_NATS_URL")
if not DSN or not NATS:
    print("SKIP: UPSQUAD_PG_DSN_MODEL_REGISTRY and UPSQUAD_NATS_URL are required")
    sys.exit(0)

import grpc  # noqa: E402
from upsquad.runtime.v1 import model_pb2 as M  # noqa: E402

health_pb2 = T.load_generated("grpc/health/v1/health_pb2.py", "health_pb2")

SVC = "/upsquad.runtime.v1.ModelRegistryService/"
SHIPPED = os.path.join(T.ROOT, "services", "model-registry", "catalog", "models.json")
MIGRATIONS = os.path.join(T.ROOT, "services", "model-registry", "migrations")
SECRET = secrets.token_hex(16)
CALL_TIMEOUT = 5

# ---- the documented scoring, re-implemented ----
ROLE_WEIGHTS = {  # reasoning, code_generation, structured_ops, long_context, tool_use_quality
    "architect": (0.40, 0.20, 0.15, 0.15, 0.10),
    "backend-sme": (0.20, 0.45, 0.15, 0.05, 0.15),
    "frontend": (0.15, 0.50, 0.15, 0.05, 0.15),
    "qa-engineer": (0.20, 0.30, 0.20, 0.05, 0.25),
    "devops": (0.20, 0.30, 0.15, 0.05, 0.30),
    "reviewer": (0.35, 0.30, 0.10, 0.20, 0.05),
    "planner": (0.45, 0.05, 0.25, 0.10, 0.15),
    "researcher": (0.35, 0.00, 0.10, 0.35, 0.20),
    "writer": (0.35, 0.00, 0.25, 0.30, 0.10),
    "general": (0.30, 0.20, 0.20, 0.15, 0.15),
}
PRICE_WEIGHT = {"quality": 0.05, "balanced": 0.20, "cost": 0.50}
ALTERNATIVES = 4
COMPARE_MAX = 100


def blended(i, o):
    return (3.0 * i + o) / 4.0


def cost_efficiency(i, o):
    b = blended(i, o)
    if b <= 0.1:
        return 1.0
    if b >= 100.0:
        return 0.0
    return (math.log10(100.0) - math.log10(b)) / (math.log10(100.0) - math.log10(0.1))


def quality(role, m):
    w = ROLE_WEIGHTS[role]
    c = m.capabilities
    return (w[0] * c.reasoning + w[1] * c.code_generation + w[2] * c.structured_ops +
            w[3] * c.long_context + w[4] * m.tool_use_quality_score)


def expected_ranking(models, role, goal, providers=None):
    p = PRICE_WEIGHT[goal]
    rows = []
    for m in models:
        if m.is_deprecated or not m.supports_tool_use:
            continue
        if providers is not None and m.provider not in providers:
            continue
        q = quality(role, m)
        s = (1.0 - p) * q + p * cost_efficiency(m.pricing.input_per_million_tokens,
                                                 m.pricing.output_per_million_tokens)
        rows.append((-s, -q, blended(m.pricing.input_per_million_tokens,
                                     m.pricing.output_per_million_tokens), m.model_id, s, q))
    rows.sort()
    return [(r[3], r[4], r[5]) for r in rows]


# ---- helpers ----
def today():
    return datetime.datetime.now(datetime.timezone.utc).date()


def test_catalog():
    """The shipped file plus test-only models that must never win a recommendation."""
    with open(SHIPPED) as f:
        doc = json.load(f)
    base = copy.deepcopy(doc["models"][0])

    def extra(model_id, provider, tools, status, price):
        m = copy.deepcopy(base)
        m.update({"model_id": model_id, "provider": provider, "display_name": model_id,
                  "supports_tool_use": tools, "tool_use_quality": 1.0 if tools else 0.0,
                  "capabilities": {"reasoning": 1.0, "code_generation": 1.0,
                                   "structured_ops": 1.0, "long_context": 1.0}})
        m["lifecycle"] = {"status": status, "deprecated_on": None,
                          "shutdown_on": "2026-01-01" if status == "retired" else None,
                          "successor": None if status == "active" else "gpt-6-luna"}
        m["prices"] = [{"effective_from": "2025-01-01", "input_per_million": price,
                        "output_per_million": price, "source_url": "https://example.test/price",
                        "verified_on": "2025-01-01", "note": "integration test model"}]
        return m

    doc["models"] += [
        extra("it-notools-perfect", "openai", False, "active", 0.01),
        extra("it-deprecated-perfect", "anthropic", True, "deprecated", 0.01),
        extra("it-legacy-old", "legacyco", True, "retired", 1.0),
        extra("it-legacy-notools", "legacyco", False, "active", 1.0),
    ]
    return doc


def auth(token):
    return (("authorization", "Bearer " + token),)


class Client:
    def __init__(self, addr):
        self.ch = grpc.insecure_channel(addr)
        self.list = self.ch.unary_unary(SVC + "ListModels",
                                        request_serializer=M.ListModelsRequest.SerializeToString,
                                        response_deserializer=M.ListModelsResponse.FromString)
        self.rec = self.ch.unary_unary(
            SVC + "GetModelRecommendation",
            request_serializer=M.GetModelRecommendationRequest.SerializeToString,
            response_deserializer=M.GetModelRecommendationResponse.FromString)
        self.cmp = self.ch.unary_unary(SVC + "CompareModels",
                                       request_serializer=M.CompareModelsRequest.SerializeToString,
                                       response_deserializer=M.CompareModelsResponse.FromString)
        self.check = self.ch.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        self.md = auth(T.mint(SECRET))

    def models(self, provider=""):
        return list(self.list(M.ListModelsRequest(provider_filter=provider), metadata=self.md,
                              timeout=CALL_TIMEOUT).models)

    def recommend(self, role="", providers=(), goal=""):
        return self.rec(M.GetModelRecommendationRequest(agent_role=role,
                                                        connected_providers=list(providers),
                                                        optimization_goal=goal),
                        metadata=self.md, timeout=CALL_TIMEOUT)

    def compare(self, ids):
        return list(self.cmp(M.CompareModelsRequest(model_ids=list(ids)), metadata=self.md,
                             timeout=CALL_TIMEOUT).models)

    def price_of(self, model_id):
        m = self.compare([model_id])[0]
        return (m.pricing.input_per_million_tokens, m.pricing.output_per_million_tokens)

    def close(self):
        self.ch.close()


def wait_until(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


class ModelRegistry(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="mr-it-")
        cls.db_created = None
        cls.dsn = DSN
        if ADMIN_DSN:
            name = "mr_it_%d_%s" % (os.getpid(), secrets.token_hex(4))
            psql(ADMIN_DSN, "CREATE DATABASE %s" % name)
            cls.db_created = name
            cls.admin = with_database(ADMIN_DSN, name)
            psql(cls.admin, "CREATE SCHEMA model_registry AUTHORIZATION model_registry")
            cls.dsn = with_database(DSN, name)
        else:
            cls.admin = None
        cls.doc = test_catalog()
        cls.file = os.path.join(cls.tmp, "models.json")
        cls.write_catalog(cls.doc)
        cls.servers = []
        cls.a = cls.start(cls.file)
        cls.b = cls.start("none", poll="1h")
        cls.ca = Client(cls.a.addr)
        cls.cb = Client(cls.b.addr)

    @classmethod
    def write_catalog(cls, doc):
        tmp = cls.file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, cls.file)

    @classmethod
    def start(cls, catalog_file, poll="30s"):
        srv = T.Server("model-registry", env={
            "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": cls.dsn, "UPSQUAD_NATS_URL": NATS,
            "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS, "UPSQUAD_MODEL_CATALOG_FILE": catalog_file,
            "UPSQUAD_MODEL_CATALOG_POLL": poll, "UPSQUAD_LOG_LEVEL": "warn"})
        cls.servers.append(srv)
        return srv

    @classmethod
    def tearDownClass(cls):
        for c in (getattr(cls, "ca", None), getattr(cls, "cb", None)):
            if c:
                c.close()
        for s in getattr(cls, "servers", []):
            s.stop()
        if cls.db_created:
            psql(ADMIN_DSN, "DROP DATABASE %s WITH (FORCE)" % cls.db_created)
        else:
            # shared database: put the shipped catalogue back (the change stays in history)
            restore = T.Server("model-registry", env={
                "UPSQUAD_JWT_SECRET": SECRET, "UPSQUAD_PG_DSN": DSN, "UPSQUAD_NATS_URL": NATS,
                "UPSQUAD_MIGRATIONS_DIR": MIGRATIONS, "UPSQUAD_MODEL_CATALOG_FILE": SHIPPED})
            restore.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def sql(self, q):
        """Reads the service's schema (as the admin when there is one, else as the service's
        own role, which may read its tables)."""
        return psql(self.admin or self.dsn, q)

    def assertCode(self, code, fn, *args, contains=None, **kw):
        with self.assertRaises(grpc.RpcError) as ctx:
            fn(*args, **kw)
        self.assertEqual(ctx.exception.code(), code, ctx.exception.details())
        if contains:
            self.assertIn(contains, ctx.exception.details())
        return ctx.exception.details()

    # ---- health and authentication ----
    def test_health_serving(self):
        for c in (self.ca, self.cb):
            for svc in ("", "upsquad.runtime.v1.ModelRegistryService"):
                r = c.check(health_pb2.HealthCheckRequest(service=svc), timeout=CALL_TIMEOUT)
                self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING)

    def test_every_method_requires_a_valid_token(self):
        now = int(time.time())
        bad = {
            "missing": (),
            "forged": auth(T.mint("not-the-secret")),
            "alg none": auth(T.mint(SECRET, alg="none")),
            "expired": auth(T.mint(SECRET, now=now - 3600, ttl=60)),
            "wrong audience": auth(T.mint(SECRET, aud="someone-else")),
            "not a jwt": auth("garbage"),
        }
        calls = {
            "ListModels": (self.ca.list, M.ListModelsRequest()),
            "GetModelRecommendation": (self.ca.rec, M.GetModelRecommendationRequest()),
            "CompareModels": (self.ca.cmp, M.CompareModelsRequest(model_ids=["gpt-5.5"])),
        }
        for cname, (fn, req) in calls.items():
            for what, md in bad.items():
                with self.subTest(method=cname, token=what):
                    self.assertCode(grpc.StatusCode.UNAUTHENTICATED, fn, req, metadata=md,
                                    timeout=CALL_TIMEOUT)

    # ---- ListModels ----
    def test_list_matches_the_data_file_in_documented_order(self):
        models = self.ca.models()
        served = {m["model_id"] for m in self.doc["models"]}
        self.assertEqual({m.model_id for m in models}, served)
        key = [(m.provider, m.is_deprecated, m.model_id) for m in models]
        self.assertEqual(key, sorted(key))
        by_id = {m["model_id"]: m for m in self.doc["models"]}
        day = today().isoformat()
        for m in models:
            f = by_id[m.model_id]
            price = [p for p in f["prices"] if p["effective_from"] <= day][-1]
            self.assertEqual(m.provider, f["provider"])
            self.assertEqual(m.display_name, f["display_name"])
            self.assertEqual(m.max_context_tokens, f["max_context_tokens"])
            self.assertEqual(m.supports_streaming, f["supports_streaming"])
            self.assertEqual(m.supports_tool_use, f["supports_tool_use"])
            self.assertEqual(m.tool_use_quality_score, f["tool_use_quality"])
            self.assertEqual(m.is_deprecated, f["lifecycle"]["status"] != "active")
            for k in ("reasoning", "code_generation", "structured_ops", "long_context"):
                self.assertEqual(getattr(m.capabilities, k), f["capabilities"][k], k)
            self.assertAlmostEqual(m.pricing.input_per_million_tokens, price["input_per_million"])
            self.assertAlmostEqual(m.pricing.output_per_million_tokens,
                                   price["output_per_million"])
            self.assertAlmostEqual(m.capabilities.cost_efficiency,
                                   cost_efficiency(price["input_per_million"],
                                                   price["output_per_million"]), places=12)
        # both replicas serve the same catalogue
        self.assertEqual([x.SerializeToString() for x in self.cb.models()],
                         [x.SerializeToString() for x in models])

    def test_scheduled_price_is_not_yet_in_force(self):
        # gemini-3.8-flash has a price row effective 2027-01-01 in the shipped file
        m = self.ca.compare(["gemini-3.8-flash"])[0]
        rows = [r for r in next(x for x in self.doc["models"]
                                if x["model_id"] == "gemini-3.8-flash")["prices"]
                if r["effective_from"] <= today().isoformat()]
        self.assertEqual(m.pricing.input_per_million_tokens, rows[-1]["input_per_million"])

    def test_provider_filter(self):
        openai = self.ca.models("OpenAI")
        self.assertTrue(openai)
        self.assertTrue(all(m.provider == "openai" for m in openai))
        self.assertEqual([m.model_id for m in openai],
                         [m.model_id for m in self.ca.models() if m.provider == "openai"])
        self.assertEqual([m.model_id for m in self.ca.models(" google ")],
                         [m.model_id for m in self.ca.models("google")])
        self.assertEqual(self.ca.models("mistral"), [])

    # ---- GetModelRecommendation ----
    def test_recommendation_follows_the_documented_scoring(self):
        models = self.ca.models()
        first = {}
        # the second round is answered from the replica's cache of encoded answers: the same
        # rules must hold, byte for byte
        for _ in range(2):
          for role in ROLE_WEIGHTS:
            for goal in PRICE_WEIGHT:
                with self.subTest(role=role, goal=goal):
                    r = self.ca.recommend(role, [], goal)
                    wire = r.SerializeToString()
                    self.assertEqual(first.setdefault((role, goal), wire), wire)
                    want = expected_ranking(models, role, goal)
                    got = [r.recommended.model_id] + [a.model_id for a in r.alternatives]
                    self.assertEqual(got, [w[0] for w in want[:1 + ALTERNATIVES]])
                    self.assertIn("score %.3f" % want[0][1], r.reasoning)
                    self.assertIn("role quality %.3f" % want[0][2], r.reasoning)
                    self.assertIn("%s role with the %s goal" % (role, goal), r.reasoning)
                    self.assertIn("connected_providers was empty", r.reasoning)
                    self.assertTrue(r.reasoning.endswith("."))
                    for m in [r.recommended] + list(r.alternatives):
                        self.assertFalse(m.is_deprecated)
                        self.assertTrue(m.supports_tool_use)
                        self.assertFalse(m.model_id.startswith("it-"))

    def test_repeated_questions_get_their_own_answers(self):
        """More distinct questions than a replica caches (64 per thread): asked again in another
        order, each gets the answer it got the first time and never another question's."""
        providers = ((), ("openai",), ("google", "anthropic"), ("Anthropic", "mistral"))
        questions = [(role, provs, goal) for role in list(ROLE_WEIGHTS) + ["astronaut", ""]
                     for provs in providers for goal in ("quality", "cost", "balanced", "")]
        self.assertGreater(len(questions), 64)
        first = {q: self.ca.recommend(q[0], q[1], q[2]).SerializeToString() for q in questions}
        self.assertGreater(len(set(first.values())), 64)
        for q in reversed(questions):
            with self.subTest(question=q):
                self.assertEqual(self.ca.recommend(q[0], q[1], q[2]).SerializeToString(), first[q])
        # the same question from another connection and replica: the same answer
        for q in questions[:8]:
            self.assertEqual(self.cb.recommend(q[0], q[1], q[2]).SerializeToString(), first[q])

    def test_default_goal_is_balanced_and_role_names_are_forgiving(self):
        a = self.ca.recommend("backend-sme")
        b = self.ca.recommend(" Backend_SME ", [], "BALANCED")
        self.assertEqual(a.SerializeToString(), b.SerializeToString())
        self.assertIn("with the balanced goal", a.reasoning)

    def test_unknown_role_falls_back_to_general(self):
        r = self.ca.recommend("astronaut", [], "quality")
        g = self.ca.recommend("general", [], "quality")
        self.assertEqual(r.recommended.model_id, g.recommended.model_id)
        self.assertIn('agent_role "astronaut" is not a known role, so the general profile was used',
                      r.reasoning)

    def test_connected_providers(self):
        models = self.ca.models()
        r = self.ca.recommend("devops", ["OpenAI", "google"], "cost")
        want = expected_ranking(models, "devops", "cost", {"openai", "google"})
        self.assertEqual([r.recommended.model_id] + [a.model_id for a in r.alternatives],
                         [w[0] for w in want[:1 + ALTERNATIVES]])
        self.assertIn("providers considered: google, openai", r.reasoning)
        r = self.ca.recommend("devops", ["anthropic", "Mistral"], "quality")
        self.assertEqual(r.recommended.provider, "anthropic")
        self.assertIn('ignored providers not in the catalogue: "Mistral"', r.reasoning)

    def test_no_qualifying_model_is_failed_precondition(self):
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.ca.recommend, "planner",
                        ["mistral"], contains="none of connected_providers")
        d = self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.ca.recommend, "planner",
                            ["legacyco"])
        self.assertIn("1 are deprecated or retired and 1 lack tool use", d)

    def test_bad_recommendation_requests(self):
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.ca.recommend, "architect", [],
                        "fastest", contains="optimization_goal")
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.ca.recommend, "architect",
                        ["openai", ""], contains="connected_providers[1]")
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.ca.recommend, "x" * 65,
                        contains="agent_role")
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.ca.recommend, "architect",
                        ["openai"] * 17, contains="connected_providers")

    # ---- CompareModels ----
    def test_compare(self):
        got = self.ca.compare(["gemini-3.5-flash", "GPT-5.5", "gemini-3.5-flash", "gpt-5.5 ",
                               "claude-opus-4-8"])
        self.assertEqual([m.model_id for m in got],
                         ["gemini-3.5-flash", "gpt-5.5", "claude-opus-4-8"])
        listed = {m.model_id: m for m in self.ca.models()}
        for m in got:
            self.assertEqual(m.SerializeToString(), listed[m.model_id].SerializeToString())
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.ca.compare, [],
                        contains="model_ids")
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.ca.compare,
                        ["gpt-5.5"] * (COMPARE_MAX + 1), contains="at most 100")
        self.assertEqual(len(self.ca.compare(["gpt-5.5"] * COMPARE_MAX)), 1)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.ca.compare, ["gpt-5.5", ""],
                        contains="model_ids[1]")
        d = self.assertCode(grpc.StatusCode.NOT_FOUND, self.ca.compare,
                            ["gpt-5.5", "no-such-model", "gpt-99"])
        self.assertIn('"no-such-model"', d)
        self.assertIn('"gpt-99"', d)

    # ---- reloads (run last: they change the catalogue) ----
    def test_zz_reload_changes_a_price_while_calls_run(self):
        day = today().isoformat()
        target = next(m for m in self.doc["models"]
                      if m["lifecycle"]["status"] == "active" and m["provider"] == "openai"
                      and m["prices"][-1]["effective_from"] < day)
        tid = target["model_id"]
        old = self.ca.price_of(tid)
        new = (round(old[0] * 1.5 + 0.25, 2), round(old[1] * 1.5 + 0.25, 2))
        self.assertEqual(self.cb.price_of(tid), old)
        loads_before = int(self.sql("SELECT count(*) FROM model_registry.catalog_loads"))

        # a question whose answer shows the model, asked (and so cached) before the change
        def priced(r):
            return {m.model_id: (m.pricing.input_per_million_tokens,
                                 m.pricing.output_per_million_tokens)
                    for m in [r.recommended] + list(r.alternatives)}
        asked = next((role, goal) for role in ROLE_WEIGHTS for goal in PRICE_WEIGHT
                     if tid in priced(self.ca.recommend(role, ["openai"], goal)))
        self.assertEqual(priced(self.ca.recommend(asked[0], ["openai"], asked[1]))[tid], old)

        stop = threading.Event()
        errors, seen = [], {}

        def hammer(name, client):
            prices = seen.setdefault(name, [])
            while not stop.is_set():
                try:
                    prices.append(client.price_of(tid))
                    client.recommend("backend-sme", ["openai"], "cost")
                except grpc.RpcError as e:
                    errors.append("%s: %s %s" % (name, e.code(), e.details()))

        threads = [threading.Thread(target=hammer, args=("%s%d" % (n, i), c))
                   for n, c in (("a", self.ca), ("b", self.cb)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            doc = copy.deepcopy(self.doc)
            row = next(m for m in doc["models"] if m["model_id"] == tid)
            row["prices"].append({"effective_from": day, "input_per_million": new[0],
                                  "output_per_million": new[1],
                                  "source_url": "https://example.test/new-price",
                                  "verified_on": day, "note": "integration test price change"})
            self.write_catalog(doc)
            self.a.signal(signal.SIGHUP)
            wait_until(lambda: self.ca.price_of(tid) == new, 15, "replica A to serve the new price")
            # the answer cached before the change is not served after it
            r = self.ca.recommend(asked[0], ["openai"], asked[1])
            self.assertEqual(priced(r).get(tid, new), new)
            wait_until(lambda: self.cb.price_of(tid) == new, 15,
                       "replica B to get the change through NATS")
            time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        self.assertEqual(errors, [])
        for name, prices in seen.items():
            self.assertTrue(prices, name)
            self.assertTrue(set(prices) <= {old, new}, (name, set(prices)))
            first_new = prices.index(new) if new in prices else len(prices)
            self.assertNotIn(old, prices[first_new:], "%s went back to the old price" % name)
        self.assertTrue(all(p[-1] == new for p in seen.values()))
        self.assertTrue(self.b.proc.poll() is None)  # B changed without a restart

        # history: the old price row is kept next to the new one
        rows = [r.split("|") for r in self.sql(
            "SELECT to_char(effective_from, 'YYYY-MM-DD'), input_per_million, output_per_million "
            "FROM model_registry.model_prices WHERE model_id = '%s' ORDER BY effective_from"
            % tid).split("\n")]
        self.assertEqual(rows[-1][0], day)
        self.assertEqual((float(rows[-1][1]), float(rows[-1][2])), new)
        self.assertEqual((float(rows[-2][1]), float(rows[-2][2])), old)
        kinds = self.sql("SELECT kind FROM model_registry.catalog_changes c JOIN "
                         "model_registry.catalog_loads l USING (load_id) WHERE c.model_id = '%s' "
                         "AND l.load_id > (SELECT min(load_id) FROM model_registry.catalog_loads)"
                         % tid)
        self.assertEqual(kinds, "price.added")
        self.assertEqual(int(self.sql("SELECT count(*) FROM model_registry.catalog_loads")),
                         loads_before + 1)
        self.__class__.doc = doc

        # a broken file on SIGHUP changes nothing: the replica keeps serving
        with open(self.file, "w") as f:
            f.write('{"schema": "upsquad.model_catalog/v1", "models": [')
        self.a.signal(signal.SIGHUP)
        time.sleep(1.0)
        self.assertEqual(self.ca.price_of(tid), new)
        self.assertEqual(int(self.sql("SELECT count(*) FROM model_registry.catalog_loads")),
                         loads_before + 1)

        # an older catalog_version (an old image restarting) is refused: nothing rolls back
        older = copy.deepcopy(doc)
        older["catalog_version"] = "2000-01-01.1"
        next(m for m in older["models"] if m["model_id"] == tid)["prices"].pop()
        self.write_catalog(older)
        self.a.signal(signal.SIGHUP)
        time.sleep(1.0)
        self.assertEqual(self.ca.price_of(tid), new)
        self.assertEqual(int(self.sql("SELECT count(*) FROM model_registry.catalog_loads")),
                         loads_before + 1)

        # a model removed from the file is unlisted everywhere, and kept in the database
        doc2 = copy.deepcopy(doc)
        doc2["models"] = [m for m in doc2["models"] if m["model_id"] != "it-deprecated-perfect"]
        self.write_catalog(doc2)
        self.a.signal(signal.SIGHUP)
        for c in (self.ca, self.cb):
            wait_until(lambda: "it-deprecated-perfect" not in {m.model_id for m in c.models()},
                       15, "the removed model to disappear")
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.ca.compare, ["it-deprecated-perfect"])
        self.assertEqual(self.sql("SELECT listed FROM model_registry.models "
                                  "WHERE model_id = 'it-deprecated-perfect'"), "f")
        self.__class__.doc = doc2

        # a restart with the same file changes nothing and records nothing
        loads = self.sql("SELECT count(*) FROM model_registry.catalog_loads")
        c = self.start(self.file)
        cc = Client(c.addr)
        try:
            self.assertEqual([m.SerializeToString() for m in cc.models()],
                             [m.SerializeToString() for m in self.ca.models()])
        finally:
            cc.close()
        self.assertEqual(self.sql("SELECT count(*) FROM model_registry.catalog_loads"), loads)

    def test_zz_history_cannot_be_rewritten(self):
        with self.assertRaises(RuntimeError) as ctx:
            psql(self.dsn, "DELETE FROM model_registry.model_prices")
        self.assertIn("keeps its history", str(ctx.exception))
        with self.assertRaises(RuntimeError):
            psql(self.dsn, "UPDATE model_registry.catalog_changes SET kind = 'model.added'")


if __name__ == "__main__":
    unittest.main(verbosity=1)
