import pytest

from sgl_pic.store.base import ChunkKV
from tests.store.helpers import make_record


@pytest.fixture
def record() -> ChunkKV:
    return make_record()
