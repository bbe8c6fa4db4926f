"""Built-in prompts of the correctness gate (``sgl_pic.cli.check``): no data to fetch.

Short retrieval prompts in the benchmarks' shape (system chunk, passage chunks, fresh
question), with passages drawn in different orders so that every chunk is reused at
several positions.
"""

from __future__ import annotations

from typing import NamedTuple

PASSAGES: tuple[str, ...] = (
    "The Rhone rises in the Swiss Alps at the Rhone Glacier and flows through Lake Geneva "
    "before crossing southeastern France. At Lyon it meets the Saone, and it reaches the "
    "Mediterranean Sea through a wide delta called the Camargue, known for its salt marshes, "
    "flamingos and white horses.",
    "Kyoto served as the capital of Japan for more than a thousand years, from 794 until the "
    "government moved to Tokyo in 1869. The city was spared from bombing during the Second "
    "World War, and it still holds about sixteen hundred Buddhist temples and four hundred "
    "Shinto shrines.",
    "Quito, the capital of Ecuador, stands at about 2,850 metres above sea level on the "
    "eastern slopes of the Pichincha volcano. It lies less than 25 kilometres south of the "
    "equator, and its historic centre was among the first places listed as World Heritage.",
    "Tromso is a city in northern Norway, about 350 kilometres north of the Arctic Circle. "
    "The sun does not set there from late May to late July, and in winter the polar night "
    "lasts for about two months, when the northern lights are often visible.",
    "Valparaiso is a port city on the central coast of Chile. It is built on dozens of steep "
    "hills, and since the late nineteenth century funicular lifts have carried people between "
    "the harbour and the neighbourhoods above, whose houses are painted in bright colours.",
    "The Danube is the second-longest river in Europe. It starts in the Black Forest of "
    "Germany and flows east for about 2,850 kilometres through ten countries, including "
    "Austria, Hungary and Serbia, before emptying into the Black Sea in Romania and Ukraine.",
    "Reykjavik is the capital and largest city of Iceland. Most of its homes are heated with "
    "water from geothermal springs, and the city sits on the southern shore of Faxa Bay, "
    "about 250 kilometres south of the Arctic Circle.",
    "Cusco, in the Andes of southern Peru, was the capital of the Inca Empire until the "
    "sixteenth century. Spanish colonial churches were built on Inca stone foundations, and "
    "the city is the usual starting point for visits to Machu Picchu.",
)

SYSTEM = (
    "You are a helpful assistant. Answer the question using the passages below. "
    "Be brief and name the place or fact the question asks for.\n"
)


class CheckPrompt(NamedTuple):
    """passages: indices into ``PASSAGES``, in prompt order."""

    passages: tuple[int, ...]
    question: str


PROMPTS: tuple[CheckPrompt, ...] = (
    CheckPrompt((0, 1, 2, 3), "Which river meets the Saone at Lyon?"),
    CheckPrompt((3, 2, 4, 5), "In which country is the city with funicular lifts?"),
    CheckPrompt((5, 0, 6, 1), "Where does the Danube begin?"),
    CheckPrompt((2, 7, 3, 6), "Which city was the capital of the Inca Empire?"),
    CheckPrompt((6, 4, 1, 7), "How are most homes in Reykjavik heated?"),
    CheckPrompt((1, 3, 5, 2), "For how long was Kyoto the capital of Japan?"),
)
