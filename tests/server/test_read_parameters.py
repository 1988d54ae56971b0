"""Read parameters a client crafts: characters a database rejects in paths and queries, and
forged cursors, are 422s naming the parameter; real cursors still page."""

from __future__ import annotations

import httpx
from factory import reference_reports

from auditor.testing.http import assert_problem
from auditor.testing.http import post_reports as post


def test_characters_a_database_rejects_in_paths_and_queries_are_422(server):
    """NUL (PostgreSQL refuses it in a string), lone surrogates, and over-long names in every
    path and query parameter: a 422 naming the parameter (a 500 on PostgreSQL before), never
    a query with them."""
    bad = ["a%00b", "%ED%A0%80", "x" * 129, "a b", "%F0%9F%92%A5"]
    for value in bad:
        for method, path, name in (
            ("GET", f"/v1/runs/{value}", "path.run_id"),
            ("GET", f"/v1/runs/{value}/report", "path.run_id"),
            ("GET", f"/v1/runs/r/report?statistic={value}", "query.statistic"),
            ("GET", f"/v1/runs/{value}/statistics/s/steps/1", "path.run_id"),
            ("GET", f"/v1/runs/r/statistics/{value}/steps/1", "path.statistic"),
            ("DELETE", f"/v1/runs/{value}", "path.run_id"),
            ("PUT", f"/v1/runs/{value}", "path.run_id"),
        ):
            r = httpx.request(method, f"{server.url}{path}", timeout=30,
                              json={"world_size": 1, "sizes": {}} if method == "PUT" else None)
            body = assert_problem(r, 422, "validation")
            assert body["errors"][0]["field"] == name, (method, path, body)
    r = server.put("/v1/runs/ok-run", json={"world_size": 1, "sizes": {}, "statistics": {"a\u0000": {}}})
    assert_problem(r, 422, "validation")
    r = post(server, [dict(reference_reports("r", buggy=False)[0], run_id="a\u0000")])
    assert assert_problem(r, 422, "validation")["errors"][0]["field"] == "reports[0].run_id"


def test_crafted_cursors_are_422_naming_the_cursor_and_real_ones_still_page(server, run_id):
    """A cursor is opaque base64 of JSON, so a caller can craft one holding values outside its
    column's range: a step beyond BIGINT or infinite (OverflowError on SQLite, DataError on
    PostgreSQL), a run id with NUL or a lone surrogate, a time beyond float range - each was a
    500 (and the connection dropped). Every one is now a 422 naming query.cursor, on the API
    listings and the runs page; the cursors the service hands out still page."""
    import base64

    def cursor(text: str) -> str:
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    reports = [r for step in range(3) for r in reference_reports(run_id, buggy=False, step=step)]
    assert post(server, reports + reference_reports(run_id + "-b", buggy=False)).status_code == 200
    steps = f"/v1/runs/{run_id}/statistics/advantages/steps"
    for text in ["1e400", "-1e400", "Infinity", "NaN", str(2**63), str(2**64), str(2**62 + 1), "-5", "1.5",
                 "true", '"3"', "[1]"]:
        r = server.get(steps, params={"cursor": cursor(text)})
        body = assert_problem(r, 422, "validation")
        assert body["errors"][0]["field"] == "query.cursor", (text, body)
    for text in ['[1e400,"a"]', '[Infinity,"a"]', '[NaN,"a"]', '[1,"a\\u0000"]', '[1,"\\ud800"]',
                 '[' + "9" * 400 + ',"a"]', '[1,"' + "x" * 129 + '"]', '[true,"a"]', '["1","a"]', '[1,5]',
                 '[1,"a",3]', '[1,"a b"]']:
        for path in ("/v1/runs", "/"):
            r = server.get(path, params={"cursor": cursor(text)})
            body = assert_problem(r, 422, "validation")
            assert body["errors"][0]["field"] == "query.cursor", (path, text, body)
    # the service's own cursors: three pages of one step each, then none
    seen, after = [], None
    for _ in range(3):
        page = server.get(steps, params={"limit": 1, **({"cursor": after} if after else {})}).json()
        seen += [s["step"] for s in page["steps"]]
        after = page["next_cursor"]
    assert seen == [0, 1, 2] and after is None
    first = server.get("/v1/runs", params={"limit": 1}).json()
    assert first["next_cursor"] is not None
    assert server.get("/v1/runs", params={"limit": 1, "cursor": first["next_cursor"]}).status_code == 200
    assert server.get("/", params={"cursor": first["next_cursor"]}).status_code == 200
    assert server.get("/healthz").status_code == 200
