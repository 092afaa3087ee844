"""The benchmark harness: suites, the case runner, measurement, results files, report logic."""
