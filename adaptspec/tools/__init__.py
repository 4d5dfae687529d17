"""Tooling, never imported while serving: the benchmark (`bench/`), the simulator, the model
builders, the Grafana dashboards and the demo. The serving path is the modules beside this
package (policy, classify, controller, runtime, ...); nothing there imports from here."""
