"""Serving on Ray Serve: the OpenAI ingress, the LLMServer replica, and the app builder.

Modules, one noun each: `protocol` (OpenAI schemas), `errors` (OpenAI error JSON), `messages`
(what an LLMServer streams), `responses` (stream events -> OpenAI bodies and SSE), `ingress`
(OpenAIIngress), `server` (LLMServer), `replica_ingress` (the LLMServer as its own HTTP ingress,
and HAProxy's ingress request router), `serving_mode` (how HTTP reaches the replicas), `metrics` (tokenflow_* metrics), `app` (build_app),
`launcher` (`tokenflow serve`), `dashboards` (the Grafana dashboards, from one panel list),
`grafana` (pushing them), `dashboards_cli` (`tokenflow dashboards`), `chart_schema` (the Helm
chart's values.schema.json from AppConfig). Nothing is imported here: the ingress must not pull in torch.
"""
