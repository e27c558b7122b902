# bench/train/strategies.sh's plot: per strategy, the memory a rank keeps between steps
# (parameters, gradients, optimizer state, stacked) beside the buffers ZeRO 2 and 3 gather
# layers into, and the median step time.
#   gnuplot -e "datafile='...'; outfile='...'; ranks=4; hosts=1" strategies.gp
set terminal pngcairo size 1000,420 font ",11"
set output outfile
set multiplot layout 1,2 title sprintf("DDP and ZeRO 1-3, 14.2 M-parameter MLP, AdamW, %d ranks on %d host(s)", ranks, hosts)
set style data histograms
set style histogram rowstacked
set style fill solid 0.8 border -1
set boxwidth 0.6
set grid ytics
set yrange [0:*]
set key top right
set title "memory per rank (MB)"
plot datafile using 2:xtic(1) title "parameters", \
     '' using 3 title "gradients", \
     '' using 4 title "optimizer state", \
     '' using 5 title "gather buffers (while running)" fillstyle pattern 4
set style histogram clustered gap 1
set title "step time (ms, median)"
set key off
plot datafile using 6:xtic(1) title "step" lc rgb "#4477aa"
unset multiplot
