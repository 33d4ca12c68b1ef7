// Pins the Prometheus operator whose CRDs (PodMonitor, ServiceMonitor, PrometheusRule) the tests
// install, so the chart's monitoring objects are checked by the operator's own schemas and
// created in the test cluster (tests/test_install.py). Only the CRD files are used. make node-assets
module github.com/netagent/netagent/hack/node-assets/prometheus-operator

go 1.26.0

require github.com/prometheus-operator/prometheus-operator v0.85.0
