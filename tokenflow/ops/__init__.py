"""Operating a cluster, beside the request path: `launcher` (`tokenflow serve`), `cluster_env`
(a Ray cluster's environment for a serving mode: switches, HAProxy files and ports),
`observe` (metrics export options), `dashboards` (the Grafana dashboards, from one panel
list), `grafana` (pushing them), `dashboards_cli` (`tokenflow dashboards`) and `chart_schema`
(the Helm chart's values.schema.json from AppConfig). Nothing here is imported by the request
path (`tokenflow.cluster`)."""
