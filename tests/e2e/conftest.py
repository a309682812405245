import pytest


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secrets") / "cluster.secret"
    path.write_text("e2e-cluster-secret\n")
    return str(path)
