"""Common English words that synthetic prompts are built from.

Ordinary lower-case words each encode to about one token in the usual BPE vocabularies, so a
prompt of ``n`` words lands near a predictable token count; the calibration in
:mod:`gateway.bench.runner` measures the ratio on the server under test.
"""

from __future__ import annotations

WORDS: tuple[str, ...] = tuple(
    """
    able about above accept across act add after again against age ago agree air all allow
    almost alone along already also always among amount animal answer any appear apple area
    arm around arrive art ask away baby back bad bag ball bank base basket beach bear beat
    because bed before begin behind believe bell below best better between big bird black
    blue board boat body bone book both bottom box boy bread break bright bring brother brown
    build busy buy call calm camp can capital car card care carry case cat catch cause center
    chair chance change charge check child choose city class clean clear climb clock close
    cloud coast coat cold color come common company compare complete contain continue control
    cook cool copy corn corner cost could count country course cover cow create cross crowd
    cup current cut dance dark day dead deal dear decide deep degree depend describe desert
    design detail develop die differ direct discuss distant divide doctor dog door double
    down draw dream dress drink drive drop dry during each early earth east easy eat edge
    effect egg eight either else end enemy energy engine enough enter equal even evening event
    ever every exact example except expect experience explain eye face fact fair fall family
    far farm fast father fear feel field fight figure fill final find fine finger finish fire
    first fish fit five floor flow flower fly follow food foot force forest form forward
    four free fresh friend front fruit full game garden gather general gentle give glad glass
    go gold good govern grass great green ground group grow guess guide hair half hand happen
    happy hard hat have head hear heart heat heavy help here high hill history hold hole home
    hope horse hot hour house huge human hundred hunt idea inch include industry insect
    instant interest iron island join joy jump just keep key kind king kitchen know lake land
    language large last late laugh lead learn leave left leg length letter level lie life
    lift light like line list listen little live long look lost loud love low machine main
    make man many map mark market matter may mean measure meet melody metal middle might mile
    milk mind minute miss modern moment money month moon more morning most mother mountain
    move much music must name nation natural near need neighbor never new next night noise
    north note notice number object ocean offer office often oil old once only open order
    other out over own page paint paper part party pass past path pattern pay people perhaps
    person picture piece place plain plan plant play please plenty point poor position
    possible power practice prepare present press pretty print probable problem produce
    product proper protect proud provide pull push quick quiet quite race radio rain raise
    reach read ready real reason receive record red region remember repeat reply rest result
    rich ride right ring rise river road rock roll room root rope rose round row rule run
    safe sail salt same sand save say school science sea season seat second see seed seem
    sell send sense sentence serve settle seven shape share sharp ship shoe shop short should
    shoulder show side sign silver simple since sing single sister sit size skill skin sky
    sleep slow small smell smile snow soft soil soldier solve some song soon sound south
    space speak special speed spend spring square stand star start station stay steam step
    stick still stone stop store story straight strange stream street strong student study
    subject success sudden sugar summer sun supply sure surface swim system table tail take
    talk teach team tell test thank thick thin thing think third though thousand three
    through throw tie time tiny together tool top total touch toward town track trade train
    travel tree trip true try turn twenty type under unit until use usual valley value
    village visit voice wait walk wall want warm wash watch water wave way wear weather week
    weight well west wheel while white whole wide wild will win wind window winter wish
    wonder wood word work world write wrong yard year yellow young
    """.split()
)
